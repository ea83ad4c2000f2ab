"""The GRPO loop and its stages: run_grpo (loop.py), sampling and scoring groups (rollouts.py),
multi-turn episodes (episodes.py), advantages and Datums (advantages.py), held-out evaluation,
solve history, and the adapter protocols users subclass (adapter.py, agent.py)."""

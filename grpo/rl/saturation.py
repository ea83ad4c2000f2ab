"""Per-item solve history: which training items the policy has saturated or never solves.

The RL guide's checklist: "when the model solves items perfectly, they stop providing signal;
prefer just-hard-enough items". Every time an item is sampled, its group's correctness is
recorded here; the loop logs how many seen items are saturated (last group all correct) or never
solved, and can retire items solved by every sample ``retire_solved_after`` times in a row (and,
optionally, ones still unsolved after ``retire_unsolved_after`` groups). The history is part of the
checkpointed loop state, so a resumed run retires exactly what the uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from grpo.rl.rollouts import ScoredGroup


@dataclass
class SolveHistory:
    appearances: dict[int, int] = field(default_factory=dict)  # item index -> groups sampled
    streak: dict[int, int] = field(default_factory=dict)  # consecutive all-correct groups
    solved: set[int] = field(default_factory=set)  # items with at least one correct sample ever
    retired: set[int] = field(default_factory=set)

    def record(self, groups: Iterable[ScoredGroup], is_correct: Callable[[float, Any], bool],
               solved_after: int = 0, unsolved_after: int = 0) -> None:
        """Add one appearance per group, then retire what the limits say (0: never)."""
        for g in groups:
            index = g.group.item_index
            correct = [is_correct(x, g.group.item) for i, x in enumerate(g.rewards) if g.scored(i)]
            if not correct:  # every reward failed: says nothing about the item
                continue
            self.appearances[index] = self.appearances.get(index, 0) + 1
            self.streak[index] = self.streak.get(index, 0) + 1 if all(correct) else 0
            if any(correct):
                self.solved.add(index)
            if solved_after and self.streak[index] >= solved_after:
                self.retired.add(index)
            if unsolved_after and index not in self.solved and self.appearances[index] >= unsolved_after:
                self.retired.add(index)

    def metrics(self, num_items: int) -> dict[str, float]:
        seen = len(self.appearances)
        return {
            "items/seen": float(seen),
            "items/saturated": sum(s > 0 for s in self.streak.values()) / max(1, seen),
            "items/never_solved": sum(i not in self.solved for i in self.appearances) / max(1, seen),
            "items/retired": float(len(self.retired)),
            "items/live": float(num_items - len(self.retired)),
        }

    # ------------------------------------------------------------------ checkpointing (JSON)

    def to_json(self) -> dict[str, Any]:
        return {"appearances": {str(k): v for k, v in self.appearances.items()},
                "streak": {str(k): v for k, v in self.streak.items()},
                "solved": sorted(self.solved), "retired": sorted(self.retired)}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> SolveHistory:
        data = data or {}
        return cls({int(k): v for k, v in data.get("appearances", {}).items()},
                   {int(k): v for k, v in data.get("streak", {}).items()},
                   set(data.get("solved", [])), set(data.get("retired", [])))

"""The Tinker/MinT client API: the client contract (protocols.py), the loss functions
(losses.py), the tinker:// checkpoint store and its RestClient, SDK parity, MinT compatibility."""

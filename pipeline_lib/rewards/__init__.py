"""Rewards shared by RL and evaluation: math.py (answer extraction + verifier), registry.py (reward functions
by name, weighted combinations), model.py (batched reward-model scoring)."""

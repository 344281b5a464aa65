"""The main job: engines, rollout manager, rollout buffer and trainer, run together in one of three modes."""

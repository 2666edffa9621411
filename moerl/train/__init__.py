"""Training: the RL policy loss (GRPO advantages, decoupled PPO-clip with importance correction)."""

from moerl.train.loss import LossConfig, group_advantages, policy_loss, sequence_count, token_count

__all__ = ["LossConfig", "group_advantages", "policy_loss", "sequence_count", "token_count"]

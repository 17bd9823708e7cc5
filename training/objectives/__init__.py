"""What the stages minimise: token losses, the language-model objective, GRPO and DPO."""

"""The training stages (pretrain, SFT, distillation, DPO, RL, MTP, QAT) and the trainer, losses
and checkpoints they share."""

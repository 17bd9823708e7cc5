"""Compiled decode steps: inductor graphs on CPUs (stored whole on disk), CUDA graphs on GPUs,
and the MTP drafter's step beside the target's."""

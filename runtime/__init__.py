"""Piper runtime: executes a plan.json on torch.distributed (NCCL on GPUs, gloo on CPUs)."""

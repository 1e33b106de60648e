"""Who runs where: launchers (torchrun, srun, local spawn), the host side of a rank (CPUs, threads), DDP / FSDP2
wrapping and the loop's few collectives."""

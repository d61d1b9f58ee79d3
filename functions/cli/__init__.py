"""The `rollbox` command (main) and its subcommands that live nowhere else."""

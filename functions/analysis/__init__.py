"""Reading what was recorded, offline: trajectories, the cost report, replay."""

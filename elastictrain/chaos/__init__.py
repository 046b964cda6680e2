"""``elastictrain chaos``: a training script under seeded faults, checked after each trial."""

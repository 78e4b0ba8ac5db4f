"""Installing kubegpu: typed values (NVIDIA chart keys where they overlap) rendered into every object."""

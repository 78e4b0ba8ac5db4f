"""The live view of the cluster's GPUs behind ``kubegpu status`` and ``kubectl gpu``."""

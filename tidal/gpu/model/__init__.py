"""The model: config, loading, layers, attention, precision and the model classes (tidal.gpu.model.registry)."""

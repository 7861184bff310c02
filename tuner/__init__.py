"""The tuner: features, cost models, simulator, ranker, search and trial store (no TensorFlow, no Ray)."""

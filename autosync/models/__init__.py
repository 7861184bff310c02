"""Keras model ingestion, profiling, user-script loading and the built-in model zoo.

Modules (import them directly; this package imports nothing heavy):
    ``ingest``   a Keras model or ModelDef -> ModelSpec (variables, sparse gradients, rows/step);
    ``profile``  measured forward+backward step time and gradient-ready order;
    ``zoo``      built-in models (``zoo:NAME?size=small|full``) with synthetic data;
    ``script``   ``path/to/script.py:function`` -> ModelDef.
"""

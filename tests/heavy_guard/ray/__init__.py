"""Stands in for ray on the PYTHONPATH of subprocesses started by tests that are not marked
integration (see tests/conftest.py): importing it there is an error."""
raise ImportError("a subprocess of a test not marked @pytest.mark.integration imported ray: mark the test "
                  "integration, or keep the fast suite free of Ray and TensorFlow")

"""Demo and test data: generated room histories (``sample``) for ``roomstore
demo`` and ``roomstore generate-sample``, the tests and the benchmarks. The
store never imports it (``tests/test_architecture.py``)."""

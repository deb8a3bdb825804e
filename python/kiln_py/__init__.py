"""kiln's Python side: the model twins (models.py) and the AOTInductor compile step (compile.py).

kiln's C++ trainer runs this package as a subprocess only to compile (`python -m kiln_py.compile`),
never in the step loop; the peer tests (bench/peer/peer.py) use the same twins.
"""

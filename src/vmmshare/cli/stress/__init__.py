"""The reliability runs (`vmmshare stress NAME`) and the harness they share with the test suite.

Each run is a script, started by path in a process of its own (``python .../stress/NAME.py``), that puts this folder
on ``sys.path`` and imports its neighbours (`common`, `procs`, `actor`, `rawsock`, `fakecuda`) by their bare names:
they are not an importable API of vmmshare.
"""

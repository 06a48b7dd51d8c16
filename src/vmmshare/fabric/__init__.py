"""The cross-server transport (SPEC §8): FABRIC handles imported on another server.

Each node's broker is its fabric agent (`agent.py`): it listens for the other brokers on VMMSHARE_FABRIC_ADDR,
proves the cluster key to them (`peer_protocol.py`), forwards its clients' remote imports to the exporting node's
broker, and serves the memory its own node exported to remote importers through the transfer engine
(`engine.py`, the only module that imports it). The importing process moves the bytes itself, one-sided, through
its own engine (`backends/remote.py`). `cluster.py` makes a test cluster of network namespaces on one machine.
"""

"""A process's side of its node's broker: the connection, starting the broker on first use, and the packets."""

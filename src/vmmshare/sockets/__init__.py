"""The node's unix sockets, as both ends use them: packets with fds and credentials, and the socket's folder."""

"""The node broker: the process that holds every exported allocation and decides who may import it."""

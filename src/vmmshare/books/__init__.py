"""The node's book, sans I/O: who holds what, who may import it, what each user is charged. The broker's loop and
the fabric agent both keep their records here; everything that touches the system is handed in."""

"""Shared memory, slot rings, wire messages and sockets: where the front and the workers meet."""

"""Adapters that put the drafter client inside a real serving engine: the engine's drafter interface on one side,
STEPs on the other. Nothing below the engines imports them."""

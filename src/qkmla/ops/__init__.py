"""Fused operators with their torch references beside them."""

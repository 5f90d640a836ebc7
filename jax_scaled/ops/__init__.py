"""Scaling operations: dynamic rescaling, casts and delayed scaling (identities outside scalify)."""

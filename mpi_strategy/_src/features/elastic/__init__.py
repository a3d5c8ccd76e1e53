"""Elastic training under ULFM: lose ranks and keep training, in place."""

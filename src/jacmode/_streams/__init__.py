"""Streaming over data sets: batches, rounds over ranks, collectives, progress, memmap pages."""

"""Splitting the model over processes: the pipeline driver, a stage process, and the frames between them.

Uses core, model and runner; implements core's Executor interface with batches in flight.
"""

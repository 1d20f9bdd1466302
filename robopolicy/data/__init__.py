"""Datasets: recording, collection, interchange, inspection and training loaders (LeRobot v3.0)."""

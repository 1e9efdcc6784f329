"""Training and search for drafters (``specdec train ...``): one module per method."""

"""What runs inside each Ray Train worker: data, models, the training loop."""

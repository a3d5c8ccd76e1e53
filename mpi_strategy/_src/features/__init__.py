"""What makes a one-process program work unchanged on N ranks: saving, Keras, elastic training."""

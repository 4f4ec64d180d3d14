"""What workers and servers share: the model spec and bucket plan, and the cheap finiteness check."""

"""What workers and servers share: the model spec and bucket plan, the cheap NaN/Inf check, the errors."""

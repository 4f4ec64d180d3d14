"""What every side of gradsync shares: the worker strategies and the parameter servers."""

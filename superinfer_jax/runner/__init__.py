"""Device execution: the model runner, its step programs and their cache, sampling."""

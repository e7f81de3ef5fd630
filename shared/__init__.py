"""Code every tokenyard process imports: frames, transport, configuration, logging, metrics."""

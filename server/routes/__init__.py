"""HTTP routes: chat completions, completions, and models / health / metrics."""

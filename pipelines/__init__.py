"""Built-in algorithms declared as pipelines (installed as `plexrl.pipelines`)."""

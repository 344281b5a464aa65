"""Moving the trainer's weights to the engines: export under HF names, then a transport."""

"""Command-line entry points: `refitctl` (operators) and the service launchers."""

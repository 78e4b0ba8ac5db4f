"""Command-line entry points: one typer app, one sub-module per command."""

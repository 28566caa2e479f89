"""kvpark."""

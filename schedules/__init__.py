"""The schedule zoo as package data (see monetlike/zoo.py); JSON files only, never code."""

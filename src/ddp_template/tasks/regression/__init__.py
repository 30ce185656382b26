"""Regression: a multilayer perceptron predicting one number from rows of numeric features."""

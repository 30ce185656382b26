"""Tabular classification: a multilayer perceptron with batch norm on scikit-learn tables."""

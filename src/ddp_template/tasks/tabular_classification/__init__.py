"""Image classification: a torchvision ResNet on digits, CIFAR-10, an image folder or noise."""

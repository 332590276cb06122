"""Floor 1: model -> GraphModule (torch.fx or torch.export), and the refusals both captures share."""

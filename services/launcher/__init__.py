"""Starting the stack: preparing the model directory and launching the processes."""

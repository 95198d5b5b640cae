from training.train_pair import main

main()

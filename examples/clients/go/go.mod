module example.com/drafter-example

go 1.19

require github.com/mtpdraft/mtpdraft/client/go v0.0.0

require (
	github.com/golang/protobuf v1.5.2 // indirect
	golang.org/x/net v0.3.0 // indirect
	golang.org/x/sys v0.5.0 // indirect
	golang.org/x/text v0.7.0 // indirect
	google.golang.org/genproto v0.0.0-20200526211855-cb27e3aa2013 // indirect
	google.golang.org/grpc v1.33.3 // indirect
	google.golang.org/protobuf v1.28.1 // indirect
)

// The client from this checkout (in your module: the path of your checkout, or none where
// the repository is published at the module's path).
replace github.com/mtpdraft/mtpdraft/client/go => ../../../client/go

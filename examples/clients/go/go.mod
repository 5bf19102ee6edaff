module example.com/drafter-example

go 1.19

require mtpdraft v0.0.0

require (
	github.com/golang/protobuf v1.5.2 // indirect
	golang.org/x/net v0.3.0 // indirect
	golang.org/x/sys v0.5.0 // indirect
	golang.org/x/text v0.7.0 // indirect
	google.golang.org/genproto v0.0.0-20200526211855-cb27e3aa2013 // indirect
	google.golang.org/grpc v1.33.3 // indirect
	google.golang.org/protobuf v1.28.1 // indirect
)

// The client from this repository (a path of your own in your module).
replace mtpdraft => ../../../client/go/src/mtpdraft
